//! KV transfer between workers: a dedicated byte stream (TCP here), framed, page-granular,
//! every frame checksummed. A handshake agrees on the model, the page size and the page layout
//! before any page moves; a mismatch is refused with the reason on both sides. Any `Read +
//! Write` stream can carry it ([`Link`]): another transport (shared memory, RDMA) replaces TCP
//! by implementing the same two traits.
//!
//! Frame: `len: u32 LE` (of what follows), `kind: u8`, body, `xxh3_128(kind ‖ body)` (LE): a
//! checksum against corruption in transit (the handshake and the page hashes carry identity;
//! the checksum only has to be fast and catch damage).
//!
//! Handshake (version 2): the sender's `Hello` (its format and a nonce); the receiver's
//! `Challenge` (its nonce and a MAC proving it holds the cluster key); the sender's `Proof`
//! (a MAC over both nonces and its `Hello`); the receiver's `Accept` or `Refuse`. Before it,
//! no frame may exceed [`HANDSHAKE_MAX_FRAME`]; after it, none may exceed what one page or one
//! `Begin` of the receiver's context needs. Nothing is allocated for a peer that has not
//! proved it holds the key. A refusal names what failed, never the receiver's values.
//! Without a cluster key on either side the proofs are zero and not checked (loopback only).
//!
//! Transfer ids are 128-bit random numbers chosen by the receiver, which accepts a `Begin`
//! only for an id it is expecting.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use strata_kv::auth::ClusterKey;
use thiserror::Error;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

const MAGIC: &[u8; 8] = b"STRATAKV";
const VERSION: u32 = 2;
/// Largest frame accepted before the handshake completed.
pub const HANDSHAKE_MAX_FRAME: usize = 16 << 10;
/// Largest frame a sender reads (acknowledgements and refusals).
const REPLY_MAX_FRAME: usize = 64 << 10;

/// A transfer's id: 128 random bits.
pub type TransferId = u128;

/// A fresh, unpredictable transfer id.
pub fn new_transfer_id() -> TransferId {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the operating system's random source");
    u128::from_le_bytes(b)
}

fn nonce() -> [u8; 16] {
    new_transfer_id().to_le_bytes()
}

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
    /// The sender's format and nonce.
    Hello {
        hello: Hello,
        nonce: [u8; 16],
    },
    /// The handshake was refused, with the reason.
    Refuse(String),
    /// The receiver's nonce and its proof of the cluster key.
    Challenge {
        nonce: [u8; 16],
        proof: [u8; 32],
    },
    /// The sender's proof of the cluster key.
    Proof {
        proof: [u8; 32],
    },
    /// The handshake passed.
    Accept,
    /// A transfer starts: its id, the prompt's tokens, the pages that follow.
    Begin {
        id: TransferId,
        tokens: Vec<u32>,
        pages: u32,
    },
    /// One page: its position in the transfer, its content hash, its bytes.
    Page {
        id: TransferId,
        index: u32,
        hash: [u8; 16],
        data: Vec<u8>,
    },
    End {
        id: TransferId,
    },
    /// The receiver's answer to `Begin` (busy: retry later) or to `End` (stored).
    Ack {
        id: TransferId,
        ok: bool,
        reason: String,
    },
    Abort {
        id: TransferId,
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
    fn u128(&mut self) -> Result<u128, TransferError> {
        Ok(u128::from_le_bytes(
            self.take(16)?.try_into().expect("16 bytes"),
        ))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], TransferError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
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
            Frame::Hello { hello, nonce } => {
                b.extend_from_slice(MAGIC);
                b.extend_from_slice(&VERSION.to_le_bytes());
                b.extend_from_slice(&hello_bytes(hello));
                b.extend_from_slice(nonce);
                1
            }
            Frame::Refuse(r) => {
                put_str(&mut b, r);
                2
            }
            Frame::Challenge { nonce, proof } => {
                b.extend_from_slice(nonce);
                b.extend_from_slice(proof);
                8
            }
            Frame::Proof { proof } => {
                b.extend_from_slice(proof);
                9
            }
            Frame::Accept => 10,
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
                Frame::Hello {
                    hello: Hello {
                        model_id: c.string()?,
                        page_size: c.u32()?,
                        page_bytes: c.u64()?,
                        layout: c.string()?,
                    },
                    nonce: c.array()?,
                }
            }
            2 => Frame::Refuse(c.string()?),
            8 => Frame::Challenge {
                nonce: c.array()?,
                proof: c.array()?,
            },
            9 => Frame::Proof { proof: c.array()? },
            10 => Frame::Accept,
            3 => {
                let id = c.u128()?;
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
                let id = c.u128()?;
                let index = c.u32()?;
                let hash = c.take(16)?.try_into().expect("16 bytes");
                Frame::Page {
                    id,
                    index,
                    hash,
                    data: c.0.to_vec(),
                }
            }
            5 => Frame::End { id: c.u128()? },
            6 => {
                let id = c.u128()?;
                let ok = c.take(1)?[0] != 0;
                Frame::Ack {
                    id,
                    ok,
                    reason: c.string()?,
                }
            }
            7 => Frame::Abort {
                id: c.u128()?,
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
    id: TransferId,
    index: u32,
    hash: &[u8; 16],
    data: &[u8],
) -> Result<(), TransferError> {
    let mut head = [0u8; PAGE_HEAD];
    let body_len = PAGE_HEAD - 5 + data.len();
    head[..4].copy_from_slice(&((body_len + 1 + 16) as u32).to_le_bytes());
    head[4] = 4;
    head[5..21].copy_from_slice(&id.to_le_bytes());
    head[21..25].copy_from_slice(&index.to_le_bytes());
    head[25..].copy_from_slice(hash);
    let mut h = Xxh3::new();
    h.update(&head[4..]);
    h.update(data);
    w.write_all(&head)?;
    w.write_all(data)?;
    w.write_all(&h.digest128().to_le_bytes())?;
    Ok(())
}

/// Length prefix, kind, id, index and hash of a page frame.
const PAGE_HEAD: usize = 4 + 1 + 16 + 4 + 16;

/// Largest frame a page of `page_bytes` needs.
pub fn page_frame_len(page_bytes: u64) -> usize {
    (PAGE_HEAD - 4 + 16) + page_bytes as usize
}

/// Largest frame a `Begin` of `max_tokens` tokens needs.
pub fn begin_frame_len(max_tokens: usize) -> usize {
    1 + 16 + 4 + 4 + 4 * max_tokens + 16
}

/// Reads one frame of at most `max` bytes (checked before anything is allocated), verifying
/// its checksum.
pub fn read_frame(r: &mut dyn Read, max: usize) -> Result<Frame, TransferError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if !(17..=max).contains(&len) {
        return Err(TransferError::Corrupt(format!(
            "frame length {len} (at most {max} here)"
        )));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    let (payload, sum) = buf.split_at(len - 16);
    if xxh3_128(payload).to_le_bytes() != sum {
        return Err(TransferError::Corrupt("checksum mismatch".into()));
    }
    let head = PAGE_HEAD - 4;
    if payload[0] == 4 && payload.len() >= head {
        // A page: keep its bytes in place instead of copying them out.
        let id = u128::from_le_bytes(payload[1..17].try_into().expect("16 bytes"));
        let index = u32::from_le_bytes(payload[17..21].try_into().expect("4 bytes"));
        let hash: [u8; 16] = payload[21..37].try_into().expect("16 bytes");
        buf.truncate(len - 16);
        buf.drain(..head);
        return Ok(Frame::Page {
            id,
            index,
            hash,
            data: buf,
        });
    }
    Frame::decode(payload[0], &payload[1..])
}

/// The fields of a `Hello` as they travel (also what the sender's proof covers).
fn hello_bytes(h: &Hello) -> Vec<u8> {
    let mut b = Vec::new();
    put_str(&mut b, &h.model_id);
    b.extend_from_slice(&h.page_size.to_le_bytes());
    b.extend_from_slice(&h.page_bytes.to_le_bytes());
    put_str(&mut b, &h.layout);
    b
}

/// Names the fields in which two formats differ. The receiver logs both sides' values; the
/// peer is told only which fields differ.
fn hello_diff(receiver: &Hello, sender: &Hello) -> Vec<&'static str> {
    let mut d = Vec::new();
    if receiver.model_id != sender.model_id {
        d.push("model");
    }
    if receiver.page_size != sender.page_size {
        d.push("page size");
    }
    if receiver.page_bytes != sender.page_bytes || receiver.layout != sender.layout {
        d.push("page layout");
    }
    d
}

const RECEIVER_PROOF: &str = "strata kv-transfer receiver v2";
const SENDER_PROOF: &str = "strata kv-transfer sender v2";

fn proof(key: Option<&ClusterKey>, context: &str, parts: &[&[u8]]) -> [u8; 32] {
    key.map(|k| k.mac(context, parts)).unwrap_or([0; 32])
}

/// Client side of the handshake: states our format, checks the receiver holds the cluster
/// key (when we have one), proves we do, and waits for the verdict.
pub fn handshake_connect(
    link: &mut dyn Link,
    me: &Hello,
    key: Option<&ClusterKey>,
) -> Result<(), TransferError> {
    let mine = nonce();
    write_frame(
        link,
        &Frame::Hello {
            hello: me.clone(),
            nonce: mine,
        },
    )?;
    let theirs = match read_frame(link, HANDSHAKE_MAX_FRAME)? {
        Frame::Challenge { nonce, proof: p } => {
            if let Some(k) = key {
                if !k.verify(RECEIVER_PROOF, &[&mine, &nonce], &p) {
                    return Err(TransferError::Refused(
                        "the receiver did not prove it holds this deployment's cluster key".into(),
                    ));
                }
            }
            nonce
        }
        Frame::Refuse(r) => return Err(TransferError::Refused(r)),
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Challenge, got {}",
                f.name()
            )))
        }
    };
    let hb = hello_bytes(me);
    let p = proof(key, SENDER_PROOF, &[&theirs, &mine, &hb]);
    write_frame(link, &Frame::Proof { proof: p })?;
    match read_frame(link, HANDSHAKE_MAX_FRAME)? {
        Frame::Accept => Ok(()),
        Frame::Refuse(r) => Err(TransferError::Refused(r)),
        f => Err(TransferError::Protocol(format!(
            "expected Accept, got {}",
            f.name()
        ))),
    }
}

/// Server side of the handshake: reads the sender's format, challenges it, checks its proof of
/// the cluster key (when we have one) and its format. Refusals name what failed only.
pub fn handshake_accept(
    link: &mut dyn Link,
    me: &Hello,
    key: Option<&ClusterKey>,
) -> Result<Hello, TransferError> {
    let (peer, theirs) = match read_frame(link, HANDSHAKE_MAX_FRAME)? {
        Frame::Hello { hello, nonce } => (hello, nonce),
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Hello, got {}",
                f.name()
            )))
        }
    };
    let mine = nonce();
    let p = proof(key, RECEIVER_PROOF, &[&theirs, &mine]);
    write_frame(
        link,
        &Frame::Challenge {
            nonce: mine,
            proof: p,
        },
    )?;
    let given = match read_frame(link, HANDSHAKE_MAX_FRAME)? {
        Frame::Proof { proof } => proof,
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Proof, got {}",
                f.name()
            )))
        }
    };
    let refuse = |link: &mut dyn Link, why: String| {
        let _ = write_frame(link, &Frame::Refuse(why.clone()));
        Err(TransferError::Refused(why))
    };
    let authentic = match key {
        Some(k) => k.verify(SENDER_PROOF, &[&mine, &theirs, &hello_bytes(&peer)], &given),
        None => given == [0; 32],
    };
    if !authentic {
        return refuse(
            link,
            "authentication failed: the sender does not hold this receiver's cluster key".into(),
        );
    }
    let diff = hello_diff(me, &peer);
    if !diff.is_empty() {
        tracing::warn!(receiver = ?me, sender = ?peer, "KV formats differ");
        return refuse(
            link,
            format!("the workers' KV formats differ in: {}", diff.join(", ")),
        );
    }
    write_frame(link, &Frame::Accept)?;
    Ok(peer)
}

impl Frame {
    /// The frame's kind in words (errors name it, never its contents).
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "Hello",
            Frame::Refuse(_) => "Refuse",
            Frame::Challenge { .. } => "Challenge",
            Frame::Proof { .. } => "Proof",
            Frame::Accept => "Accept",
            Frame::Begin { .. } => "Begin",
            Frame::Page { .. } => "Page",
            Frame::End { .. } => "End",
            Frame::Ack { .. } => "Ack",
            Frame::Abort { .. } => "Abort",
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
    id: TransferId,
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
        match read_frame(link, REPLY_MAX_FRAME)? {
            Frame::Ack { ok: true, .. } => break,
            Frame::Ack {
                ok: false, reason, ..
            } => {
                st.busy_retries += 1;
                if t.elapsed() >= deadline {
                    return Err(TransferError::Timeout(deadline));
                }
                tracing::debug!(%reason, "KV receiver busy; retrying");
                std::thread::sleep(Duration::from_millis(10));
            }
            Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
            f => {
                return Err(TransferError::Protocol(format!(
                    "expected Ack, got {}",
                    f.name()
                )))
            }
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
    match read_frame(link, REPLY_MAX_FRAME)? {
        Frame::Ack { ok: true, .. } => {}
        Frame::Ack {
            ok: false, reason, ..
        }
        | Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Ack, got {}",
                f.name()
            )))
        }
    }
    st.seconds = t.elapsed().as_secs_f64();
    Ok(st)
}

/// One received transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    pub id: TransferId,
    pub tokens: Vec<u32>,
    pub hashes: Vec<[u8; 16]>,
    /// Page blobs in order.
    pub pages: Vec<Vec<u8>>,
}

/// What the receiver's pool takes: every frame is checked against these before it is read.
#[derive(Clone, Copy, Debug)]
pub struct RecvLimits {
    pub page_bytes: u64,
    pub page_size: u32,
    /// Longest prompt (the receiver's context length).
    pub max_tokens: usize,
}

impl RecvLimits {
    fn max_frame(&self) -> usize {
        page_frame_len(self.page_bytes)
            .max(begin_frame_len(self.max_tokens))
            .max(REPLY_MAX_FRAME)
    }
}

/// The receiver's verdict on a `Begin`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// No room now: the sender retries.
    Busy(String),
    /// Never: the transfer is aborted.
    Refuse(String),
}

fn ack(link: &mut dyn Link, id: TransferId, ok: bool, reason: &str) -> Result<(), TransferError> {
    write_frame(
        link,
        &Frame::Ack {
            id,
            ok,
            reason: reason.to_string(),
        },
    )
}

fn abort(link: &mut dyn Link, id: TransferId, reason: String) -> TransferError {
    let _ = write_frame(
        link,
        &Frame::Abort {
            id,
            reason: reason.clone(),
        },
    );
    TransferError::Protocol(reason)
}

/// Receives one transfer on an open link. A `Begin` must be consistent (1 to `max_tokens`
/// tokens, exactly the pages they fill); then `admit(id, pages)` decides. Pages must arrive
/// in order with the agreed size; anything else aborts the transfer and nothing of it is kept.
pub fn recv_kv(
    link: &mut dyn Link,
    lim: &RecvLimits,
    admit: &mut dyn FnMut(TransferId, u32) -> Admit,
) -> Result<Received, TransferError> {
    let max = lim.max_frame();
    let (id, tokens, n) = loop {
        match read_frame(link, max)? {
            Frame::Begin { id, tokens, pages } => {
                let want = tokens.len().div_ceil(lim.page_size.max(1) as usize);
                if tokens.is_empty() || tokens.len() > lim.max_tokens {
                    return Err(abort(
                        link,
                        id,
                        format!(
                            "{} tokens: a transfer carries 1 to {}",
                            tokens.len(),
                            lim.max_tokens
                        ),
                    ));
                }
                if pages as usize != want {
                    return Err(abort(
                        link,
                        id,
                        format!("{pages} pages announced for {} tokens", tokens.len()),
                    ));
                }
                match admit(id, pages) {
                    Admit::Yes => {
                        ack(link, id, true, "")?;
                        break (id, tokens, pages);
                    }
                    Admit::Busy(why) => ack(link, id, false, &why)?,
                    Admit::Refuse(why) => return Err(abort(link, id, why)),
                }
            }
            f => {
                return Err(TransferError::Protocol(format!(
                    "expected Begin, got {}",
                    f.name()
                )))
            }
        }
    };
    let mut r = Received {
        id,
        tokens,
        hashes: Vec::with_capacity(n as usize),
        pages: Vec::with_capacity(n as usize),
    };
    loop {
        match read_frame(link, max)? {
            Frame::Page {
                id: pid,
                index,
                hash,
                data,
            } => {
                let bad = if pid != id {
                    Some("a page of another transfer".to_string())
                } else if index as usize != r.pages.len() {
                    Some(format!("page {index} arrived, expected {}", r.pages.len()))
                } else if data.len() as u64 != lim.page_bytes {
                    Some(format!(
                        "page of {} bytes, agreed {}",
                        data.len(),
                        lim.page_bytes
                    ))
                } else if r.pages.len() as u32 >= n {
                    Some(format!("more than the {n} pages announced"))
                } else {
                    None
                };
                if let Some(reason) = bad {
                    return Err(abort(link, id, reason));
                }
                r.hashes.push(hash);
                r.pages.push(data);
            }
            Frame::End { id: eid } if eid == id => {
                if r.pages.len() as u32 != n {
                    let reason = format!("{} of {n} pages before End", r.pages.len());
                    return Err(abort(link, id, reason));
                }
                ack(link, id, true, "")?;
                return Ok(r);
            }
            Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
            f => return Err(TransferError::Protocol(format!("unexpected {}", f.name()))),
        }
    }
}

/// A TCP stream whose peer must keep up. It follows the frame boundaries (the length prefix):
/// waiting for a frame to start is bounded by `idle`; once a frame has started, all of it must
/// arrive within `grace` + its length / `min_rate`; and an optional hard deadline bounds
/// everything (the handshake). A peer that trickles (a byte now and then) is cut off instead of
/// holding a thread and a buffer forever.
pub struct Paced {
    conn: TcpStream,
    idle: Duration,
    grace: Duration,
    min_rate: u64,
    head: [u8; 4],
    head_got: usize,
    /// Bytes of the current frame still to come.
    left: u64,
    frame_deadline: Option<Instant>,
    hard_deadline: Option<Instant>,
}

impl Paced {
    pub fn new(conn: TcpStream, idle: Duration, grace: Duration, min_rate: u64) -> Paced {
        Paced {
            conn,
            idle,
            grace,
            min_rate: min_rate.max(1),
            head: [0; 4],
            head_got: 0,
            left: 0,
            frame_deadline: None,
            hard_deadline: None,
        }
    }

    /// Bounds everything read until it is cleared (e.g. the handshake).
    pub fn set_deadline(&mut self, d: Option<Instant>) {
        self.hard_deadline = d;
    }

    /// Follows the frame structure through `bytes` just read.
    fn account(&mut self, mut bytes: &[u8], now: Instant) {
        while !bytes.is_empty() {
            if self.left == 0 {
                let take = (4 - self.head_got).min(bytes.len());
                self.head[self.head_got..self.head_got + take].copy_from_slice(&bytes[..take]);
                self.head_got += take;
                bytes = &bytes[take..];
                if self.head_got == 4 {
                    self.head_got = 0;
                    self.left = u32::from_le_bytes(self.head) as u64;
                    self.frame_deadline = (self.left > 0).then(|| {
                        now + self.grace
                            + Duration::from_secs_f64(self.left as f64 / self.min_rate as f64)
                    });
                } else {
                    self.frame_deadline.get_or_insert(now + self.grace);
                }
            } else {
                let take = (self.left as usize).min(bytes.len());
                self.left -= take as u64;
                bytes = &bytes[take..];
                if self.left == 0 {
                    self.frame_deadline = None;
                }
            }
        }
    }
}

impl Read for Paced {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let now = Instant::now();
        let slow = || {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the peer is too slow: a frame (or the handshake) did not arrive in time \
                     (at least {} bytes/s after {:.1} s of grace)",
                    self.min_rate,
                    self.grace.as_secs_f64()
                ),
            )
        };
        let mut wait = self.idle;
        let mut bounded = false;
        for d in [self.frame_deadline, self.hard_deadline]
            .into_iter()
            .flatten()
        {
            if now >= d {
                return Err(slow());
            }
            if d - now < wait {
                wait = d - now;
                bounded = true;
            }
        }
        self.conn
            .set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
        let n = match self.conn.read(buf) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(if bounded {
                    slow()
                } else {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("the peer sent nothing for {:.1} s", self.idle.as_secs_f64()),
                    )
                })
            }
            Err(e) => return Err(e),
        };
        self.account(&buf[..n], Instant::now());
        Ok(n)
    }
}

impl Write for Paced {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.conn.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.conn.flush()
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

    fn lim() -> RecvLimits {
        RecvLimits {
            page_bytes: 64,
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
            let mut first = true;
            recv_kv(&mut s, &lim(), &mut |got, n| {
                assert_eq!((got, n), (id, 3));
                if std::mem::replace(&mut first, false) {
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
        let st = send_kv(&mut c, id, &[1, 2, 3], &pages, Duration::from_secs(5)).unwrap();
        assert_eq!((st.pages, st.bytes, st.busy_retries), (3, 192, 1));
        let r = rx.join().unwrap();
        assert_eq!(r.id, id);
        assert_eq!(r.tokens, vec![1, 2, 3]);
        assert_eq!(r.pages, blobs);
        assert_eq!(r.hashes[2], [2; 16]);
    }

    #[test]
    fn a_mismatched_handshake_is_refused_naming_the_field_not_the_values() {
        let (mut c, mut s) = pair();
        let rx =
            std::thread::spawn(move || handshake_accept(&mut s, &hello(32), None).unwrap_err());
        let e = handshake_connect(&mut c, &hello(16), None).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("differ in: page size"), "{msg}");
        assert!(!msg.contains("32"), "the receiver's value leaked: {msg}");
        assert!(rx.join().unwrap().to_string().contains("page size"));
    }

    #[test]
    fn a_peer_without_the_cluster_key_is_refused_both_ways() {
        // Sender with another key: the receiver refuses it, and the sender sees the receiver
        // did not prove the sender's key either.
        let (mut c, mut s) = pair();
        let rx = std::thread::spawn(move || {
            handshake_accept(&mut s, &hello(1), Some(&key(1))).unwrap_err()
        });
        let e = handshake_connect(&mut c, &hello(1), Some(&key(2))).unwrap_err();
        assert!(e.to_string().contains("cluster key"), "{e}");
        drop(c);
        let _ = rx.join().unwrap();
        // Sender without a key, receiver with one: refused.
        let (mut c, mut s) = pair();
        let rx = std::thread::spawn(move || {
            handshake_accept(&mut s, &hello(1), Some(&key(1))).unwrap_err()
        });
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
        for (tokens, pages, verdict, want) in [
            (
                vec![1u32; 3],
                2u32,
                Admit::Yes,
                "2 pages announced for 3 tokens",
            ),
            (vec![1u32; 101], 101, Admit::Yes, "101 tokens"),
            (
                vec![1u32; 3],
                3,
                Admit::Refuse("unknown transfer id".into()),
                "unknown transfer id",
            ),
        ] {
            let (mut c, mut s) = pair();
            let v = verdict.clone();
            let rx = std::thread::spawn(move || {
                recv_kv(&mut s, &lim(), &mut |_, _| v.clone()).unwrap_err()
            });
            write_frame(
                &mut c,
                &Frame::Begin {
                    id: 7,
                    tokens,
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
            recv_kv(&mut s, &lim(), &mut |_, _| Admit::Yes)
        });
        handshake_connect(&mut c, &hello(1), None).unwrap();
        write_frame(
            &mut c,
            &Frame::Begin {
                id: 1,
                tokens: vec![1; 4],
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
}
