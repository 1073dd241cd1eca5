//! One transfer: `Begin`, the pages (at once, or as they are computed with `Wait`s between),
//! `End`, acknowledged; the receiver checks every frame against its limits.

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

/// Sends one request's KV at once: `Begin` (retried while the receiver is busy, until
/// `deadline`), the pages — the prompt's pages from index `first` on (the receiver holds the
/// ones before) — `End`, then waits for the receiver's `Ack`.
pub fn send_kv(
    link: &mut dyn Link,
    id: TransferId,
    tokens: &[u32],
    first: u32,
    pages: &[OutPage],
    deadline: Duration,
) -> Result<TransferStats, TransferError> {
    let mut s = begin_kv(link, id, tokens, first, pages.len() as u32, deadline)?;
    for p in pages {
        s.page(p)?;
    }
    s.end()
}

/// A transfer under way whose pages are sent as they come (a prefill worker sends each chunk's
/// pages while it computes the next): [`begin_kv`], then [`KvSender::page`] for every page in
/// order ([`KvSender::wait`] while none is ready), then [`KvSender::end`]. Dropped before its
/// end, it aborts the transfer.
pub struct KvSender<'a> {
    link: &'a mut dyn Link,
    id: TransferId,
    next: u32,
    end: u32,
    deadline: Duration,
    /// Time spent sending (writing pages, awaiting the `Ack`), not waiting for pages.
    busy: Duration,
    st: TransferStats,
    done: bool,
}

/// Starts a transfer: `Begin` for `tokens`' `pages` pages from index `first` on (retried while
/// the receiver is busy, until `deadline`; the sending's own `deadline` starts after it).
pub fn begin_kv<'a>(
    link: &'a mut dyn Link,
    id: TransferId,
    tokens: &[u32],
    first: u32,
    pages: u32,
    deadline: Duration,
) -> Result<KvSender<'a>, TransferError> {
    let t = Instant::now();
    let mut st = TransferStats::default();
    loop {
        let begin = Frame::Begin {
            id,
            tokens: tokens.to_vec(),
            first,
            pages,
        };
        write_frame(link, &begin)?;
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
            f => return Err(unexpected("Ack", &f)),
        }
    }
    Ok(KvSender {
        link,
        id,
        next: first,
        end: first + pages,
        deadline,
        busy: Duration::ZERO,
        st,
        done: false,
    })
}

fn unexpected(want: &str, f: &Frame) -> TransferError {
    TransferError::Protocol(format!("expected {want}, got {}", f.name()))
}

impl KvSender<'_> {
    /// Sends the next page (its index follows the last one's). Past `deadline` of sending
    /// (time spent waiting for pages not counted), the transfer is aborted.
    pub fn page(&mut self, p: &OutPage) -> Result<(), TransferError> {
        if self.next >= self.end {
            return Err(TransferError::Protocol(format!(
                "more than the {} pages announced",
                self.end
            )));
        }
        if self.busy >= self.deadline {
            self.abort("sender deadline");
            return Err(TransferError::Timeout(self.deadline));
        }
        let t = Instant::now();
        write_page_frame(self.link, self.id, self.next, &p.hash, p.data)?;
        self.busy += t.elapsed();
        self.next += 1;
        self.st.pages += 1;
        self.st.bytes += p.data.len() as u64;
        Ok(())
    }

    /// Tells the receiver the next pages are being computed (call at least every
    /// [`super::WAIT_EVERY`] while waiting for them).
    pub fn wait(&mut self) -> Result<(), TransferError> {
        write_frame(self.link, &Frame::Wait { id: self.id })
    }

    /// Ends the transfer once every page announced was sent: `End`, then the receiver's
    /// `Ack`. Its stats count the time spent sending, not waiting for pages.
    pub fn end(mut self) -> Result<TransferStats, TransferError> {
        self.done = true;
        if self.next != self.end {
            let reason = format!("{} of the pages announced were sent", self.st.pages);
            self.abort(&reason);
            return Err(TransferError::Protocol(reason));
        }
        let t = Instant::now();
        write_frame(self.link, &Frame::End { id: self.id })?;
        match read_frame(self.link, REPLY_MAX_FRAME)? {
            Frame::Ack { ok: true, .. } => {}
            Frame::Ack {
                ok: false, reason, ..
            }
            | Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
            f => return Err(unexpected("Ack", &f)),
        }
        self.busy += t.elapsed();
        self.st.seconds = self.busy.as_secs_f64();
        Ok(self.st)
    }

    /// Aborts the transfer, telling the receiver why (best effort).
    pub fn abort(&mut self, reason: &str) {
        self.done = true;
        let _ = write_frame(
            self.link,
            &Frame::Abort {
                id: self.id,
                reason: reason.to_string(),
            },
        );
    }
}

impl Drop for KvSender<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.abort("the sender stopped before the transfer's end");
        }
    }
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
    recv_kv_watched(link, lim, admit, &mut |_| true)
}

/// [`recv_kv`], asking `wanted(id)` at each `Wait`: once the transfer is no longer wanted
/// (its request gave up), it is aborted there instead of waiting on.
pub fn recv_kv_watched(
    link: &mut dyn Link,
    lim: &RecvLimits,
    admit: &mut dyn FnMut(TransferId, u32, u32) -> Admit,
    wanted: &mut dyn FnMut(TransferId) -> bool,
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
    recv_pages(link, lim, max, r, n, wanted)
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

/// Reads the `n` pages of transfer `r.id` into `r`, then its `End`, and acknowledges it. A
/// transfer no longer `wanted` (asked at every frame) is aborted; so is one whose sender sends
/// `Wait`s faster than one each half [`super::WAIT_EVERY`] (beyond a few), which would only
/// hold the receiver's place.
fn recv_pages(
    link: &mut dyn Link,
    lim: &RecvLimits,
    max: usize,
    mut r: Received,
    n: u32,
    wanted: &mut dyn FnMut(TransferId) -> bool,
) -> Result<Received, TransferError> {
    let id = r.id;
    let (began, mut waits) = (Instant::now(), 0u64);
    loop {
        let f = read_frame(link, max)?;
        if !wanted(id) {
            let reason = "the receiver no longer wants this transfer".to_string();
            return Err(abort(link, id, reason));
        }
        match f {
            Frame::Page {
                id: pid,
                index,
                hash,
                data,
            } => {
                if let Some(reason) = bad_page(lim, &r, n, (pid, index, data.len())) {
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
            // The sender computes the next pages: the wait for a frame starts again.
            Frame::Wait { id: wid } if wid == id => {
                waits += 1;
                let half = super::WAIT_EVERY.as_millis() as u64 / 2;
                if waits > 4 + began.elapsed().as_millis() as u64 / half.max(1) {
                    let reason = "Wait frames faster than one each half second".to_string();
                    return Err(abort(link, id, reason));
                }
            }
            Frame::Abort { reason, .. } => return Err(TransferError::Aborted(reason)),
            f => return Err(TransferError::Protocol(format!("unexpected {}", f.name()))),
        }
    }
}

/// Why page `index` of `len` bytes, of transfer `pid`, does not belong next in `r` (of `n`
/// pages announced), if it does not.
fn bad_page(
    lim: &RecvLimits,
    r: &Received,
    n: u32,
    (pid, index, len): (TransferId, u32, usize),
) -> Option<String> {
    let next = r.first as usize + r.pages.len();
    if pid != r.id {
        Some("a page of another transfer".to_string())
    } else if index as usize != next {
        Some(format!("page {index} arrived, expected {next}"))
    } else if len as u64 != lim.page_bytes && Some(len as u64) != lim.main_page_bytes {
        Some(format!("page of {len} bytes, agreed {}", lim.page_bytes))
    } else if r.pages.len() as u32 >= n {
        Some(format!("more than the {n} pages announced"))
    } else {
        None
    }
}
