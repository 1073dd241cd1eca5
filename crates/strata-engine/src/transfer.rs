//! KV transfer between workers: a dedicated byte stream (TCP here), framed, page-granular,
//! every frame checksummed. A handshake agrees on the model, the page size and the page layout
//! before any page moves; a mismatch is refused with the reason on both sides. Any `Read +
//! Write` stream can carry it ([`Link`]): another transport (shared memory, RDMA) replaces TCP
//! by implementing the same two traits.
//!
//! Frame: `len: u32 LE` (of what follows), `kind: u8`, body, `xxh3_128(kind ‖ body)` (LE): a
//! checksum against corruption in transit (the handshake and the page hashes carry identity;
//! the checksum only has to be fast and catch damage).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use thiserror::Error;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

const MAGIC: &[u8; 8] = b"STRATAKV";
const VERSION: u32 = 1;
/// Largest frame accepted (a page of a large model is well below).
pub const MAX_FRAME: usize = 256 << 20;

/// A byte stream between two workers.
pub trait Link: Read + Write + Send {}
impl<T: Read + Write + Send> Link for T {}

/// What each side states at the handshake; both must be equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub model_id: String,
    pub page_size: u32,
    /// Bytes of one page (all pool kinds).
    pub page_bytes: u64,
    /// The layout's description (pool kinds, layers, planes, bytes per token).
    pub layout: String,
}

/// A transfer that failed; the message names what went wrong.
#[derive(Debug, Error)]
pub enum TransferError {
    #[error("KV transfer I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("KV transfer: corrupt frame ({0})")]
    Corrupt(String),
    #[error("KV transfer handshake refused: {0}")]
    Refused(String),
    #[error("KV transfer protocol: {0}")]
    Protocol(String),
    #[error("KV transfer aborted by the peer: {0}")]
    Aborted(String),
    #[error("KV transfer timed out after {0:?}")]
    Timeout(Duration),
}

/// The messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    /// The handshake was refused, with the reason.
    Refuse(String),
    /// A transfer starts: request id, the prompt's tokens, the pages that follow.
    Begin {
        id: u64,
        tokens: Vec<u32>,
        pages: u32,
    },
    /// One page: its position in the transfer, its content hash, its bytes.
    Page {
        id: u64,
        index: u32,
        hash: [u8; 16],
        data: Vec<u8>,
    },
    End {
        id: u64,
    },
    /// The receiver's answer to `Begin` (busy: retry later) or to `End` (stored).
    Ack {
        id: u64,
        ok: bool,
        reason: String,
    },
    Abort {
        id: u64,
        reason: String,
    },
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], TransferError> {
        if self.0.len() < n {
            return Err(TransferError::Corrupt(
                "frame shorter than its fields".into(),
            ));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, TransferError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, TransferError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn string(&mut self) -> Result<String, TransferError> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| TransferError::Corrupt("a string is not UTF-8".into()))
    }
}

impl Frame {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        let kind: u8 = match self {
            Frame::Hello(h) => {
                b.extend_from_slice(MAGIC);
                b.extend_from_slice(&VERSION.to_le_bytes());
                put_str(&mut b, &h.model_id);
                b.extend_from_slice(&h.page_size.to_le_bytes());
                b.extend_from_slice(&h.page_bytes.to_le_bytes());
                put_str(&mut b, &h.layout);
                1
            }
            Frame::Refuse(r) => {
                put_str(&mut b, r);
                2
            }
            Frame::Begin { id, tokens, pages } => {
                b.extend_from_slice(&id.to_le_bytes());
                b.extend_from_slice(&pages.to_le_bytes());
                b.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                for t in tokens {
                    b.extend_from_slice(&t.to_le_bytes());
                }
                3
            }
            Frame::Page {
                id,
                index,
                hash,
                data,
            } => {
                b.extend_from_slice(&id.to_le_bytes());
                b.extend_from_slice(&index.to_le_bytes());
                b.extend_from_slice(hash);
                b.extend_from_slice(data);
                4
            }
            Frame::End { id } => {
                b.extend_from_slice(&id.to_le_bytes());
                5
            }
            Frame::Ack { id, ok, reason } => {
                b.extend_from_slice(&id.to_le_bytes());
                b.push(*ok as u8);
                put_str(&mut b, reason);
                6
            }
            Frame::Abort { id, reason } => {
                b.extend_from_slice(&id.to_le_bytes());
                put_str(&mut b, reason);
                7
            }
        };
        let mut out = Vec::with_capacity(b.len() + 21);
        out.extend_from_slice(&((b.len() + 1 + 16) as u32).to_le_bytes());
        out.push(kind);
        let mut h = Xxh3::new();
        h.update(&[kind]);
        h.update(&b);
        out.extend_from_slice(&b);
        out.extend_from_slice(&h.digest128().to_le_bytes());
        out
    }

    fn decode(kind: u8, body: &[u8]) -> Result<Frame, TransferError> {
        let mut c = Cursor(body);
        let f = match kind {
            1 => {
                if c.take(8)? != MAGIC {
                    return Err(TransferError::Protocol(
                        "the peer is not a Strata KV endpoint".into(),
                    ));
                }
                let v = c.u32()?;
                if v != VERSION {
                    return Err(TransferError::Refused(format!(
                        "protocol version {v}, this worker speaks {VERSION}"
                    )));
                }
                Frame::Hello(Hello {
                    model_id: c.string()?,
                    page_size: c.u32()?,
                    page_bytes: c.u64()?,
                    layout: c.string()?,
                })
            }
            2 => Frame::Refuse(c.string()?),
            3 => {
                let id = c.u64()?;
                let pages = c.u32()?;
                let n = c.u32()? as usize;
                let raw = c.take(
                    n.checked_mul(4)
                        .ok_or_else(|| TransferError::Corrupt("token count overflows".into()))?,
                )?;
                let tokens = raw
                    .chunks_exact(4)
                    .map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")))
                    .collect();
                Frame::Begin { id, tokens, pages }
            }
            4 => {
                let id = c.u64()?;
                let index = c.u32()?;
                let hash = c.take(16)?.try_into().expect("16 bytes");
                Frame::Page {
                    id,
                    index,
                    hash,
                    data: c.0.to_vec(),
                }
            }
            5 => Frame::End { id: c.u64()? },
            6 => {
                let id = c.u64()?;
                let ok = c.take(1)?[0] != 0;
                Frame::Ack {
                    id,
                    ok,
                    reason: c.string()?,
                }
            }
            7 => Frame::Abort {
                id: c.u64()?,
                reason: c.string()?,
            },
            k => return Err(TransferError::Corrupt(format!("unknown frame kind {k}"))),
        };
        Ok(f)
    }
}

/// Writes one frame.
pub fn write_frame(w: &mut dyn Write, f: &Frame) -> Result<(), TransferError> {
    w.write_all(&f.encode())?;
    w.flush()?;
    Ok(())
}

/// Writes a `Page` frame straight from the page's bytes (no intermediate copy); the same
/// bytes as `write_frame(Frame::Page { .. })`.
pub fn write_page_frame(
    w: &mut dyn Write,
    id: u64,
    index: u32,
    hash: &[u8; 16],
    data: &[u8],
) -> Result<(), TransferError> {
    let mut head = [0u8; 4 + 1 + 8 + 4 + 16];
    let body_len = 8 + 4 + 16 + data.len();
    head[..4].copy_from_slice(&((body_len + 1 + 16) as u32).to_le_bytes());
    head[4] = 4;
    head[5..13].copy_from_slice(&id.to_le_bytes());
    head[13..17].copy_from_slice(&index.to_le_bytes());
    head[17..].copy_from_slice(hash);
    let mut h = Xxh3::new();
    h.update(&head[4..]);
    h.update(data);
    w.write_all(&head)?;
    w.write_all(data)?;
    w.write_all(&h.digest128().to_le_bytes())?;
    Ok(())
}

/// Reads one frame, verifying its length bound and checksum.
pub fn read_frame(r: &mut dyn Read) -> Result<Frame, TransferError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if !(17..=MAX_FRAME).contains(&len) {
        return Err(TransferError::Corrupt(format!("frame length {len}")));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    let (payload, sum) = buf.split_at(len - 16);
    if xxh3_128(payload).to_le_bytes() != sum {
        return Err(TransferError::Corrupt("checksum mismatch".into()));
    }
    if payload[0] == 4 && payload.len() >= 29 {
        // A page: keep its bytes in place instead of copying them out.
        let id = u64::from_le_bytes(payload[1..9].try_into().expect("8 bytes"));
        let index = u32::from_le_bytes(payload[9..13].try_into().expect("4 bytes"));
        let hash: [u8; 16] = payload[13..29].try_into().expect("16 bytes");
        buf.truncate(len - 16);
        buf.drain(..29);
        return Ok(Frame::Page {
            id,
            index,
            hash,
            data: buf,
        });
    }
    Frame::decode(payload[0], &payload[1..])
}

/// Compares the two sides' hellos; the message names each side's value.
fn check_hello(me: &Hello, peer: &Hello, me_receiver: bool) -> Result<(), String> {
    let (r, s) = if me_receiver { (me, peer) } else { (peer, me) };
    let mut diffs = Vec::new();
    if r.model_id != s.model_id {
        diffs.push(format!(
            "model: receiver `{}`, sender `{}`",
            r.model_id, s.model_id
        ));
    }
    if r.page_size != s.page_size {
        diffs.push(format!(
            "page size: receiver {} tokens, sender {} tokens",
            r.page_size, s.page_size
        ));
    }
    if r.page_bytes != s.page_bytes || r.layout != s.layout {
        diffs.push(format!(
            "layout: receiver {} ({} bytes/page), sender {} ({} bytes/page)",
            r.layout, r.page_bytes, s.layout, s.page_bytes
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the workers' KV formats differ: {}",
            diffs.join("; ")
        ))
    }
}

/// Client side of the handshake: sends ours, reads theirs (or their refusal).
pub fn handshake_connect(link: &mut dyn Link, me: &Hello) -> Result<(), TransferError> {
    write_frame(link, &Frame::Hello(me.clone()))?;
    match read_frame(link)? {
        Frame::Hello(peer) => check_hello(me, &peer, false).map_err(TransferError::Refused),
        Frame::Refuse(r) => Err(TransferError::Refused(r)),
        f => Err(TransferError::Protocol(format!(
            "expected Hello, got {f:?}"
        ))),
    }
}

/// Server side of the handshake: reads theirs; answers ours, or a refusal naming the mismatch.
pub fn handshake_accept(link: &mut dyn Link, me: &Hello) -> Result<(), TransferError> {
    let peer = match read_frame(link)? {
        Frame::Hello(h) => h,
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Hello, got {f:?}"
            )))
        }
    };
    match check_hello(me, &peer, true) {
        Ok(()) => write_frame(link, &Frame::Hello(me.clone())),
        Err(reason) => {
            let _ = write_frame(link, &Frame::Refuse(reason.clone()));
            Err(TransferError::Refused(reason))
        }
    }
}

/// One page to send.
pub struct OutPage<'a> {
    pub hash: [u8; 16],
    pub data: &'a [u8],
}

/// Bytes and time of one transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TransferStats {
    pub pages: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// `Begin`s answered busy before one was accepted.
    pub busy_retries: u32,
}

/// Sends one request's KV: `Begin` (retried while the receiver is busy, until `deadline`),
/// the pages, `End`, then waits for the receiver's `Ack`.
pub fn send_kv(
    link: &mut dyn Link,
    id: u64,
    tokens: &[u32],
    pages: &[OutPage],
    deadline: Duration,
) -> Result<TransferStats, TransferError> {
    let t = Instant::now();
    let mut st = TransferStats::default();
    loop {
        write_frame(
            link,
            &Frame::Begin {
                id,
                tokens: tokens.to_vec(),
                pages: pages.len() as u32,
            },
        )?;
        match read_frame(link)? {
            Frame::Ack { ok: true, .. } => break,
            Frame::Ack {
                ok: false, reason, ..
            } => {
                st.busy_retries += 1;
                if t.elapsed() >= deadline {
                    return Err(TransferError::Timeout(deadline));
                }
                tracing::debug!(id, %reason, "KV receiver busy; retrying");
                std::thread::sleep(Duration::from_millis(10));
            }
            Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
            f => return Err(TransferError::Protocol(format!("expected Ack, got {f:?}"))),
        }
    }
    for (i, p) in pages.iter().enumerate() {
        if t.elapsed() >= deadline {
            let _ = write_frame(
                link,
                &Frame::Abort {
                    id,
                    reason: "sender deadline".into(),
                },
            );
            return Err(TransferError::Timeout(deadline));
        }
        write_page_frame(link, id, i as u32, &p.hash, p.data)?;
        st.pages += 1;
        st.bytes += p.data.len() as u64;
    }
    write_frame(link, &Frame::End { id })?;
    match read_frame(link)? {
        Frame::Ack { ok: true, .. } => {}
        Frame::Ack {
            ok: false, reason, ..
        }
        | Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
        f => return Err(TransferError::Protocol(format!("expected Ack, got {f:?}"))),
    }
    st.seconds = t.elapsed().as_secs_f64();
    Ok(st)
}

/// One received transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    pub id: u64,
    pub tokens: Vec<u32>,
    pub hashes: Vec<[u8; 16]>,
    /// Page blobs in order.
    pub pages: Vec<Vec<u8>>,
}

fn ack(link: &mut dyn Link, id: u64, ok: bool, reason: &str) -> Result<(), TransferError> {
    write_frame(
        link,
        &Frame::Ack {
            id,
            ok,
            reason: reason.to_string(),
        },
    )
}

/// Receives one transfer on an open link. `admit(pages)` says whether there is room (false:
/// busy, the sender retries). Pages must arrive in order with the agreed size; anything else
/// aborts the transfer and nothing of it is kept.
pub fn recv_kv(
    link: &mut dyn Link,
    page_bytes: u64,
    admit: &mut dyn FnMut(u32) -> bool,
) -> Result<Received, TransferError> {
    let (id, tokens, n) = loop {
        match read_frame(link)? {
            Frame::Begin { id, tokens, pages } => {
                if admit(pages) {
                    ack(link, id, true, "")?;
                    break (id, tokens, pages);
                }
                ack(link, id, false, "receiver has no room now")?;
            }
            f => {
                return Err(TransferError::Protocol(format!(
                    "expected Begin, got {f:?}"
                )))
            }
        }
    };
    let mut r = Received {
        id,
        tokens,
        hashes: Vec::new(),
        pages: Vec::new(),
    };
    loop {
        let f = read_frame(link)?;
        match f {
            Frame::Page {
                id: pid,
                index,
                hash,
                data,
            } => {
                let bad = if pid != id {
                    Some(format!("page for request {pid} inside transfer {id}"))
                } else if index as usize != r.pages.len() {
                    Some(format!("page {index} arrived, expected {}", r.pages.len()))
                } else if data.len() as u64 != page_bytes {
                    Some(format!("page of {} bytes, agreed {page_bytes}", data.len()))
                } else if r.pages.len() as u32 >= n {
                    Some(format!("more than the {n} pages announced"))
                } else {
                    None
                };
                if let Some(reason) = bad {
                    let _ = write_frame(
                        link,
                        &Frame::Abort {
                            id,
                            reason: reason.clone(),
                        },
                    );
                    return Err(TransferError::Protocol(reason));
                }
                r.hashes.push(hash);
                r.pages.push(data);
            }
            Frame::End { id: eid } if eid == id => {
                if r.pages.len() as u32 != n {
                    let reason = format!("{} of {n} pages before End", r.pages.len());
                    let _ = write_frame(
                        link,
                        &Frame::Abort {
                            id,
                            reason: reason.clone(),
                        },
                    );
                    return Err(TransferError::Protocol(reason));
                }
                ack(link, id, true, "")?;
                return Ok(r);
            }
            Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
            f => return Err(TransferError::Protocol(format!("unexpected {f:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
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

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[test]
    fn pages_arrive_intact_after_a_busy_answer() {
        let (mut c, mut s) = pair();
        let rx = std::thread::spawn(move || {
            handshake_accept(&mut s, &hello(16)).unwrap();
            let mut first = true;
            recv_kv(&mut s, 64, &mut |n| {
                assert_eq!(n, 3);
                !std::mem::replace(&mut first, false)
            })
            .unwrap()
        });
        handshake_connect(&mut c, &hello(16)).unwrap();
        let blobs: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 64]).collect();
        let pages: Vec<OutPage> = blobs
            .iter()
            .enumerate()
            .map(|(i, d)| OutPage {
                hash: [i as u8; 16],
                data: d,
            })
            .collect();
        let st = send_kv(&mut c, 9, &[1, 2, 3], &pages, Duration::from_secs(5)).unwrap();
        assert_eq!((st.pages, st.bytes, st.busy_retries), (3, 192, 1));
        let r = rx.join().unwrap();
        assert_eq!(r.id, 9);
        assert_eq!(r.tokens, vec![1, 2, 3]);
        assert_eq!(r.pages, blobs);
        assert_eq!(r.hashes[2], [2; 16]);
    }

    #[test]
    fn a_mismatched_handshake_is_refused_on_both_sides() {
        let (mut c, mut s) = pair();
        let rx = std::thread::spawn(move || handshake_accept(&mut s, &hello(32)).unwrap_err());
        let e = handshake_connect(&mut c, &hello(16)).unwrap_err();
        assert!(
            e.to_string()
                .contains("page size: receiver 32 tokens, sender 16 tokens"),
            "{e}"
        );
        let e = rx.join().unwrap();
        assert!(
            e.to_string()
                .contains("page size: receiver 32 tokens, sender 16 tokens"),
            "{e}"
        );
    }

    #[test]
    fn a_flipped_bit_is_caught() {
        let mut bytes = Frame::End { id: 5 }.encode();
        let mut r: &[u8] = &bytes.clone();
        assert_eq!(read_frame(&mut r).unwrap(), Frame::End { id: 5 });
        bytes[7] ^= 1;
        let mut r: &[u8] = &bytes;
        assert!(matches!(read_frame(&mut r), Err(TransferError::Corrupt(_))));
    }

    #[test]
    fn a_peer_that_dies_mid_transfer_is_an_error_not_a_partial_result() {
        let (mut c, mut s) = pair();
        let rx = std::thread::spawn(move || {
            handshake_accept(&mut s, &hello(16)).unwrap();
            recv_kv(&mut s, 64, &mut |_| true)
        });
        handshake_connect(&mut c, &hello(16)).unwrap();
        write_frame(
            &mut c,
            &Frame::Begin {
                id: 1,
                tokens: vec![1],
                pages: 4,
            },
        )
        .unwrap();
        assert!(matches!(
            read_frame(&mut c).unwrap(),
            Frame::Ack { ok: true, .. }
        ));
        let d = vec![0u8; 64];
        write_frame(
            &mut c,
            &Frame::Page {
                id: 1,
                index: 0,
                hash: [0; 16],
                data: d,
            },
        )
        .unwrap();
        drop(c);
        let e = rx.join().unwrap().unwrap_err();
        assert!(matches!(e, TransferError::Io(_)), "{e}");
    }
}
