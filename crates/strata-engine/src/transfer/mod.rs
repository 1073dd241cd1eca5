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
//!
//! A transfer (version 4): `Begin`, its pages in order — sent as the sender's prefill computes
//! them, with a `Wait` at least every [`WAIT_EVERY`] while it computes the next ones — `End`,
//! and the receiver's `Ack`.

use std::io::{Read, Write};
use std::time::Duration;

use thiserror::Error;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

const MAGIC: &[u8; 8] = b"STRATAKV";
const VERSION: u32 = 4;
/// Largest frame accepted before the handshake completed.
pub const HANDSHAKE_MAX_FRAME: usize = 16 << 10;
/// A streaming sender waiting for its next pages sends a `Wait` this often (well inside any
/// receiver's wait for a frame to start).
pub const WAIT_EVERY: Duration = Duration::from_secs(1);
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
    /// A transfer starts: its id, the prompt's tokens, the index of the first page sent (the
    /// receiver holds those before it) and how many pages follow.
    Begin {
        id: TransferId,
        tokens: Vec<u32>,
        first: u32,
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
    /// The sender is still computing the transfer's next pages (sent while it waits, so the
    /// receiver's wait for a frame to start stays bounded).
    Wait {
        id: TransferId,
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
    /// A count, then that many token ids.
    fn tokens(&mut self) -> Result<Vec<u32>, TransferError> {
        let n = self.u32()? as usize;
        let raw = self.take(
            n.checked_mul(4)
                .ok_or_else(|| TransferError::Corrupt("token count overflows".into()))?,
        )?;
        Ok(raw
            .chunks_exact(4)
            .map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")))
            .collect())
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
        let kind = self.put_body(&mut b);
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

    /// Appends the frame's body to `b`; its kind.
    fn put_body(&self, b: &mut Vec<u8>) -> u8 {
        match self {
            Frame::Hello { hello, nonce } => {
                b.extend_from_slice(MAGIC);
                b.extend_from_slice(&VERSION.to_le_bytes());
                b.extend_from_slice(&hello_bytes(hello));
                b.extend_from_slice(nonce);
                1
            }
            Frame::Refuse(r) => {
                put_str(b, r);
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
            Frame::Begin {
                id,
                tokens,
                first,
                pages,
            } => {
                b.extend_from_slice(&id.to_le_bytes());
                b.extend_from_slice(&first.to_le_bytes());
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
                put_str(b, reason);
                6
            }
            Frame::Abort { id, reason } => {
                b.extend_from_slice(&id.to_le_bytes());
                put_str(b, reason);
                7
            }
            Frame::Wait { id } => {
                b.extend_from_slice(&id.to_le_bytes());
                11
            }
        }
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
            3 => Frame::Begin {
                id: c.u128()?,
                first: c.u32()?,
                pages: c.u32()?,
                tokens: c.tokens()?,
            },
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
            11 => Frame::Wait { id: c.u128()? },
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
    let sum = h.digest128().to_le_bytes();
    // One system call for the frame (most of the time), not three.
    let mut parts = [
        std::io::IoSlice::new(&head),
        std::io::IoSlice::new(data),
        std::io::IoSlice::new(&sum),
    ];
    let mut parts = &mut parts[..];
    while !parts.is_empty() {
        match w.write_vectored(parts) {
            Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into()),
            Ok(n) => std::io::IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
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
    1 + 16 + 4 + 4 + 4 + 4 * max_tokens + 16
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
    // The kind and, for a page, its header first: a page's bytes are then read straight
    // into their own buffer (no copy out of a frame buffer).
    let head = PAGE_HEAD - 4;
    let mut first = [0u8; PAGE_HEAD - 4];
    let k = len.min(head);
    r.read_exact(&mut first[..k])?;
    if first[0] == 4 && len >= head + 16 {
        let mut data = page_buffer(len - head - 16);
        r.read_exact(&mut data)?;
        let mut sum = [0u8; 16];
        r.read_exact(&mut sum)?;
        let mut h = Xxh3::new();
        h.update(&first);
        h.update(&data);
        if h.digest128().to_le_bytes() != sum {
            return Err(TransferError::Corrupt("checksum mismatch".into()));
        }
        return Ok(Frame::Page {
            id: u128::from_le_bytes(first[1..17].try_into().expect("16 bytes")),
            index: u32::from_le_bytes(first[17..21].try_into().expect("4 bytes")),
            hash: first[21..37].try_into().expect("16 bytes"),
            data,
        });
    }
    let mut buf = vec![0u8; len];
    buf[..k].copy_from_slice(&first[..k]);
    r.read_exact(&mut buf[k..])?;
    let (payload, sum) = buf.split_at(len - 16);
    if xxh3_128(payload).to_le_bytes() != sum {
        return Err(TransferError::Corrupt("checksum mismatch".into()));
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
            Frame::Wait { .. } => "Wait",
        }
    }
}

mod buffers;
mod handshake;
mod paced;
mod stream;
#[cfg(test)]
mod tests;

pub use buffers::{page_buffer, recycle};
pub use handshake::{handshake_accept, handshake_accept_if, handshake_connect};
pub use paced::Paced;
pub use stream::{
    begin_kv, recv_kv, recv_kv_watched, send_kv, Admit, KvSender, OutPage, Received, RecvLimits,
    TransferStats,
};
