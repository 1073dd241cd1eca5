//! Tests of the transfer protocol over real loopback sockets.

use std::io::Write;
use std::time::Duration;

use strata_kv::auth::ClusterKey;

use super::*;
use std::net::{TcpListener, TcpStream};

fn hello(ps: u32) -> Hello {
    Hello {
        model_id: "m".into(),
        page_size: ps,
        page_bytes: 64,
        layout: "kv:2x2x16".into(),
    }
}

fn lim() -> RecvLimits {
    RecvLimits {
        page_bytes: 64,
        main_page_bytes: None,
        page_size: 1,
        max_tokens: 100,
    }
}

fn key(b: u8) -> ClusterKey {
    ClusterKey::from_secret(&[b; 32]).unwrap()
}

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

#[test]
fn pages_arrive_intact_after_a_busy_answer() {
    let (mut c, mut s) = pair();
    let id = new_transfer_id();
    let rx = std::thread::spawn(move || {
        handshake_accept(&mut s, &hello(1), Some(&key(1))).unwrap();
        let mut busy = true;
        recv_kv(&mut s, &lim(), &mut |got, first, n| {
            assert_eq!((got, first, n), (id, 0, 3));
            if std::mem::replace(&mut busy, false) {
                Admit::Busy("full".into())
            } else {
                Admit::Yes
            }
        })
        .unwrap()
    });
    handshake_connect(&mut c, &hello(1), Some(&key(1))).unwrap();
    let blobs: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 64]).collect();
    let pages: Vec<OutPage> = blobs
        .iter()
        .enumerate()
        .map(|(i, d)| OutPage {
            hash: [i as u8; 16],
            data: d,
        })
        .collect();
    let st = send_kv(&mut c, id, &[1, 2, 3], 0, &pages, Duration::from_secs(5)).unwrap();
    assert_eq!((st.pages, st.bytes, st.busy_retries), (3, 192, 1));
    let r = rx.join().unwrap();
    assert_eq!(r.id, id);
    assert_eq!(r.tokens, vec![1, 2, 3]);
    assert_eq!(r.pages, blobs);
    assert_eq!(r.hashes[2], [2; 16]);
}

#[test]
fn a_transfer_may_start_after_the_pages_the_receiver_holds() {
    let (mut c, mut s) = pair();
    let rx = std::thread::spawn(move || {
        handshake_accept(&mut s, &hello(1), None).unwrap();
        recv_kv(&mut s, &lim(), &mut |_, first, n| {
            assert_eq!((first, n), (3, 2));
            Admit::Yes
        })
        .unwrap()
    });
    handshake_connect(&mut c, &hello(1), None).unwrap();
    let blobs: Vec<Vec<u8>> = (3..5u8).map(|i| vec![i; 64]).collect();
    let pages: Vec<OutPage> = blobs
        .iter()
        .map(|d| OutPage {
            hash: [d[0]; 16],
            data: d,
        })
        .collect();
    let st = send_kv(
        &mut c,
        9,
        &[1, 2, 3, 4, 5],
        3,
        &pages,
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!((st.pages, st.bytes), (2, 128));
    let r = rx.join().unwrap();
    assert_eq!((r.first, r.pages.clone()), (3, blobs));
}

#[test]
fn a_mismatched_handshake_is_refused_naming_the_field_not_the_values() {
    let (mut c, mut s) = pair();
    let rx = std::thread::spawn(move || handshake_accept(&mut s, &hello(32), None).unwrap_err());
    let e = handshake_connect(&mut c, &hello(16), None).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("differ in: page size"), "{msg}");
    assert!(!msg.contains("32"), "the receiver's value leaked: {msg}");
    assert!(rx.join().unwrap().to_string().contains("page size"));
}

/// A sender of another protocol version is told so in a `Refuse`: it fails at once, naming
/// both versions (a bare close would have it reconnect until its deadline).
#[test]
fn another_protocol_version_is_refused_in_words() {
    let (mut c, mut s) = pair();
    let rx = std::thread::spawn(move || handshake_accept(&mut s, &hello(1), Some(&key(1))));
    let mut f = Frame::Hello {
        hello: hello(1),
        nonce: [7; 16],
    }
    .encode();
    // The version follows the length, the kind and the 8-byte magic.
    f[13..17].copy_from_slice(&(VERSION - 1).to_le_bytes());
    let mut h = Xxh3::new();
    let end = f.len() - 16;
    h.update(&f[4..end]);
    let sum = h.digest128().to_le_bytes();
    f[end..].copy_from_slice(&sum);
    c.write_all(&f).unwrap();
    let want = format!(
        "protocol version {}, this worker speaks {VERSION}",
        VERSION - 1
    );
    match read_frame(&mut c, HANDSHAKE_MAX_FRAME).unwrap() {
        Frame::Refuse(why) => assert_eq!(why, want),
        f => panic!("{}", f.name()),
    }
    assert!(rx.join().unwrap().unwrap_err().to_string().contains(&want));
}

#[test]
fn a_peer_without_the_cluster_key_is_refused_both_ways() {
    // Sender with another key: the receiver refuses it, and the sender sees the receiver
    // did not prove the sender's key either.
    let (mut c, mut s) = pair();
    let rx =
        std::thread::spawn(move || handshake_accept(&mut s, &hello(1), Some(&key(1))).unwrap_err());
    let e = handshake_connect(&mut c, &hello(1), Some(&key(2))).unwrap_err();
    assert!(e.to_string().contains("cluster key"), "{e}");
    drop(c);
    let _ = rx.join().unwrap();
    // Sender without a key, receiver with one: refused.
    let (mut c, mut s) = pair();
    let rx =
        std::thread::spawn(move || handshake_accept(&mut s, &hello(1), Some(&key(1))).unwrap_err());
    let e = handshake_connect(&mut c, &hello(1), None).unwrap_err();
    assert!(e.to_string().contains("authentication failed"), "{e}");
    assert!(rx
        .join()
        .unwrap()
        .to_string()
        .contains("authentication failed"));
}

#[test]
fn oversized_frames_are_refused_before_allocation() {
    // A 200 MiB length prefix where a handshake is expected.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&(200u32 << 20).to_le_bytes());
    let mut r: &[u8] = &bytes;
    let e = read_frame(&mut r, HANDSHAKE_MAX_FRAME).unwrap_err();
    assert!(e.to_string().contains("frame length"), "{e}");
}

#[test]
fn inconsistent_or_refused_begins_abort() {
    for (tokens, first, pages, verdict, want) in [
        (
            vec![1u32; 3],
            0,
            2u32,
            Admit::Yes,
            "2 pages from page 0 announced for 3 tokens",
        ),
        (
            vec![1u32; 3],
            3,
            0u32,
            Admit::Yes,
            "0 pages from page 3 announced for 3 tokens",
        ),
        (
            vec![1u32; 3],
            1,
            3u32,
            Admit::Yes,
            "3 pages from page 1 announced for 3 tokens",
        ),
        (vec![1u32; 101], 0, 101, Admit::Yes, "101 tokens"),
        (
            vec![1u32; 3],
            0,
            3,
            Admit::Refuse("unknown transfer id".into()),
            "unknown transfer id",
        ),
    ] {
        let (mut c, mut s) = pair();
        let v = verdict.clone();
        let rx = std::thread::spawn(move || {
            recv_kv(&mut s, &lim(), &mut |_, _, _| v.clone()).unwrap_err()
        });
        write_frame(
            &mut c,
            &Frame::Begin {
                id: 7,
                tokens,
                first,
                pages,
            },
        )
        .unwrap();
        match read_frame(&mut c, REPLY_MAX_FRAME).unwrap() {
            Frame::Abort { reason, .. } => assert!(reason.contains(want), "{reason}"),
            f => panic!("{f:?}"),
        }
        assert!(rx.join().unwrap().to_string().contains(want));
    }
}

#[test]
fn a_flipped_bit_is_caught() {
    let mut bytes = Frame::End { id: 5 }.encode();
    let mut r: &[u8] = &bytes.clone();
    assert_eq!(read_frame(&mut r, 1024).unwrap(), Frame::End { id: 5 });
    bytes[7] ^= 1;
    let mut r: &[u8] = &bytes;
    assert!(matches!(
        read_frame(&mut r, 1024),
        Err(TransferError::Corrupt(_))
    ));
}

#[test]
fn a_trickling_peer_is_cut_off() {
    let (mut c, s) = pair();
    let mut p = Paced::new(
        s,
        Duration::from_secs(5),
        Duration::from_millis(200),
        1 << 20,
    );
    let t = std::thread::spawn(move || read_frame(&mut p, 1 << 20));
    // A frame of 64 KiB announced, then one byte every 100 ms.
    c.write_all(&(65536u32).to_le_bytes()).unwrap();
    for _ in 0..30 {
        if c.write_all(&[0]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let e = t.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("too slow"), "{e}");
}

#[test]
fn a_peer_that_dies_mid_transfer_is_an_error_not_a_partial_result() {
    let (mut c, mut s) = pair();
    let rx = std::thread::spawn(move || {
        handshake_accept(&mut s, &hello(1), None).unwrap();
        recv_kv(&mut s, &lim(), &mut |_, _, _| Admit::Yes)
    });
    handshake_connect(&mut c, &hello(1), None).unwrap();
    write_frame(
        &mut c,
        &Frame::Begin {
            id: 1,
            tokens: vec![1; 4],
            first: 0,
            pages: 4,
        },
    )
    .unwrap();
    assert!(matches!(
        read_frame(&mut c, REPLY_MAX_FRAME).unwrap(),
        Frame::Ack { ok: true, .. }
    ));
    write_page_frame(&mut c, 1, 0, &[0; 16], &[0u8; 64]).unwrap();
    drop(c);
    let e = rx.join().unwrap().unwrap_err();
    assert!(matches!(e, TransferError::Io(_)), "{e}");
}

#[test]
fn page_frames_written_in_place_equal_encoded_ones() {
    let f = Frame::Page {
        id: 0xABCD_u128 << 64,
        index: 3,
        hash: [5; 16],
        data: vec![9; 64],
    };
    let mut a = Vec::new();
    write_page_frame(&mut a, 0xABCD_u128 << 64, 3, &[5; 16], &[9; 64]).unwrap();
    assert_eq!(a, f.encode());
    let mut r: &[u8] = &a;
    assert_eq!(read_frame(&mut r, page_frame_len(64)).unwrap(), f);
}

/// Pages sent as they come, with `Wait`s between, arrive as one transfer; a receiver whose
/// transfer is no longer wanted cuts it at the next `Wait`; a sender dropped midway aborts.
#[test]
fn a_streamed_transfer_waits_between_its_parts_and_can_be_cut() {
    let blobs: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 64]).collect();
    let page = |i: usize| OutPage {
        hash: [i as u8; 16],
        data: &blobs[i],
    };
    // Whole: pages, waits between them, end.
    let (mut c, mut s) = pair();
    let waits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let w2 = waits.clone();
    let rx = std::thread::spawn(move || {
        handshake_accept(&mut s, &hello(1), None).unwrap();
        recv_kv_watched(&mut s, &lim(), &mut |_, _, _| Admit::Yes, &mut |_| {
            w2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            true
        })
        .unwrap()
    });
    handshake_connect(&mut c, &hello(1), None).unwrap();
    let mut tx = begin_kv(&mut c, 5, &[1, 2, 3], 0, 3, Duration::from_secs(5)).unwrap();
    tx.page(&page(0)).unwrap();
    tx.wait().unwrap();
    tx.wait().unwrap();
    tx.page(&page(1)).unwrap();
    tx.page(&page(2)).unwrap();
    assert!(tx.page(&page(2)).is_err(), "more pages than announced");
    let st = tx.end().unwrap();
    assert_eq!((st.pages, st.bytes), (3, 192));
    let r = rx.join().unwrap();
    assert_eq!(r.pages, blobs);
    // Asked at every frame: three pages, two waits, the end.
    assert_eq!(waits.load(std::sync::atomic::Ordering::SeqCst), 6);

    // A flood of `Wait`s (a sender holding the receiver's place with no page) is cut.
    let (mut c, mut s) = pair();
    let rx = std::thread::spawn(move || {
        handshake_accept(&mut s, &hello(1), None).unwrap();
        recv_kv(&mut s, &lim(), &mut |_, _, _| Admit::Yes).unwrap_err()
    });
    handshake_connect(&mut c, &hello(1), None).unwrap();
    let mut tx = begin_kv(&mut c, 8, &[1, 2, 3], 0, 3, Duration::from_secs(5)).unwrap();
    for _ in 0..20 {
        if tx.wait().is_err() {
            break;
        }
    }
    let e = rx.join().unwrap();
    assert!(
        e.to_string().contains("faster than one each half second"),
        "{e}"
    );
    drop(tx);

    // Unwanted: the receiver aborts at the next frame; the sender fails (a write to the
    // closed connection, or the `Abort` read at its end).
    let (mut c, mut s) = pair();
    let rx = std::thread::spawn(move || {
        handshake_accept(&mut s, &hello(1), None).unwrap();
        recv_kv_watched(&mut s, &lim(), &mut |_, _, _| Admit::Yes, &mut |_| false).unwrap_err()
    });
    handshake_connect(&mut c, &hello(1), None).unwrap();
    let mut tx = begin_kv(&mut c, 6, &[1, 2, 3], 0, 3, Duration::from_secs(5)).unwrap();
    tx.page(&page(0)).unwrap();
    tx.wait().unwrap();
    let e = rx.join().unwrap();
    assert!(e.to_string().contains("no longer wants"), "{e}");
    let sent = tx.page(&page(1)).and_then(|_| tx.page(&page(2)));
    assert!(sent.is_err() || tx.end().is_err(), "the sender failed");

    // Dropped midway: the receiver is told the sender stopped.
    let (mut c, mut s) = pair();
    let rx = std::thread::spawn(move || {
        handshake_accept(&mut s, &hello(1), None).unwrap();
        recv_kv(&mut s, &lim(), &mut |_, _, _| Admit::Yes).unwrap_err()
    });
    handshake_connect(&mut c, &hello(1), None).unwrap();
    let mut tx = begin_kv(&mut c, 7, &[1, 2, 3], 0, 3, Duration::from_secs(5)).unwrap();
    tx.page(&page(0)).unwrap();
    drop(tx);
    let e = rx.join().unwrap();
    assert!(
        e.to_string().contains("stopped before the transfer's end"),
        "{e}"
    );
}
