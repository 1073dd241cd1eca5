//! One transfer: `Begin`, the pages, `End`, acknowledged; the receiver checks every frame
//! against its limits.

use std::time::{Duration, Instant};

use super::{
    begin_frame_len, page_frame_len, read_frame, write_frame, write_page_frame, Frame, Link,
    TransferError, TransferId, REPLY_MAX_FRAME,
};

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
/// the pages — the prompt's pages from index `first` on (the receiver holds the ones before)
/// — `End`, then waits for the receiver's `Ack`.
pub fn send_kv(
    link: &mut dyn Link,
    id: TransferId,
    tokens: &[u32],
    first: u32,
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
                first,
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
        write_page_frame(link, id, first + i as u32, &p.hash, p.data)?;
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
    /// Index of the first page received (the receiver holds those before it).
    pub first: u32,
    pub hashes: Vec<[u8; 16]>,
    /// Page blobs in order, from page `first` on.
    pub pages: Vec<Vec<u8>>,
}

/// What the receiver's pool takes: every frame is checked against these before it is read.
#[derive(Clone, Copy, Debug)]
pub struct RecvLimits {
    pub page_bytes: u64,
    /// Also accepted: pages of this many bytes, their main part alone (a layout with window
    /// kinds sends a page older than the window without its window part).
    pub main_page_bytes: Option<u64>,
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
/// tokens, exactly the pages they fill from its first one on); then `admit(id, first,
/// pages)` decides. Pages must arrive in order with the agreed size; anything else aborts
/// the transfer and nothing of it is kept.
pub fn recv_kv(
    link: &mut dyn Link,
    lim: &RecvLimits,
    admit: &mut dyn FnMut(TransferId, u32, u32) -> Admit,
) -> Result<Received, TransferError> {
    let max = lim.max_frame();
    let (id, tokens, first, n) = recv_begin(link, lim, max, admit)?;
    let r = Received {
        id,
        tokens,
        first,
        hashes: Vec::with_capacity(n as usize),
        pages: Vec::with_capacity(n as usize),
    };
    recv_pages(link, lim, max, r, n)
}

/// Reads `Begin`s until one is admitted (answering busy ones); returns its id, tokens, first
/// page and page count.
fn recv_begin(
    link: &mut dyn Link,
    lim: &RecvLimits,
    max: usize,
    admit: &mut dyn FnMut(TransferId, u32, u32) -> Admit,
) -> Result<(TransferId, Vec<u32>, u32, u32), TransferError> {
    loop {
        match read_frame(link, max)? {
            Frame::Begin {
                id,
                tokens,
                first,
                pages,
            } => {
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
                if first as usize >= want || pages as usize != want - first as usize {
                    return Err(abort(
                        link,
                        id,
                        format!(
                            "{pages} pages from page {first} announced for {} tokens",
                            tokens.len()
                        ),
                    ));
                }
                match admit(id, first, pages) {
                    Admit::Yes => {
                        ack(link, id, true, "")?;
                        return Ok((id, tokens, first, pages));
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
    }
}

/// Reads the `n` pages of transfer `r.id` into `r`, then its `End`, and acknowledges it.
fn recv_pages(
    link: &mut dyn Link,
    lim: &RecvLimits,
    max: usize,
    mut r: Received,
    n: u32,
) -> Result<Received, TransferError> {
    let id = r.id;
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
                } else if index as usize != r.first as usize + r.pages.len() {
                    Some(format!(
                        "page {index} arrived, expected {}",
                        r.first as usize + r.pages.len()
                    ))
                } else if data.len() as u64 != lim.page_bytes
                    && Some(data.len() as u64) != lim.main_page_bytes
                {
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
