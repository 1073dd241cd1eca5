//! A TCP stream whose peer must keep up.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

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
    /// The read timeout set on the socket last (set again only when it must shrink or has
    /// grown stale, not on every read: a read is a few hundred kilobytes at most).
    timeout: Option<Duration>,
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
            timeout: None,
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
        let wait = wait.max(Duration::from_millis(1));
        // A timeout already set that is no longer than `wait` and not much shorter still
        // bounds this read as it should.
        let fits = self.timeout.is_some_and(|t| t <= wait && t * 5 >= wait * 4);
        if !fits {
            self.conn.set_read_timeout(Some(wait))?;
            self.timeout = Some(wait);
        }
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
