//! A breaker over the tier's round trips. While Redis is down or hung, every batch would wait
//! out the operation timeout, and the worker looks pages up on its admission path, so each
//! request would pay it (an outage made a worker ~45× slower). After [`TRIP`] batches in a row
//! that got no reply from Redis, batches fail at once (counted, served as misses) for a
//! backoff, 1 s doubling up to [`MAX_BACKOFF`]; then one batch goes through as a probe (the
//! others still fail at once), and a reply closes the breaker.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Batches in a row without a reply that open the breaker.
pub const TRIP: u32 = 3;
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(16);

#[derive(Debug)]
pub(crate) struct Breaker {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    failed_in_row: u32,
    /// Open until then (None: closed).
    open_until: Option<Instant>,
    backoff: Duration,
    /// A probe is out: others fail at once until it comes back.
    probing: bool,
}

impl Breaker {
    pub fn new() -> Breaker {
        Breaker {
            state: Mutex::new(State {
                failed_in_row: 0,
                open_until: None,
                backoff: FIRST_BACKOFF,
                probing: false,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a batch may go to Redis now; Err: it fails at once, with why.
    pub fn allow(&self, now: Instant) -> Result<(), String> {
        let mut s = self.state();
        let Some(until) = s.open_until else {
            return Ok(());
        };
        if now < until || s.probing {
            let left = until.saturating_duration_since(now).as_secs_f64();
            return Err(format!(
                "Redis is skipped ({} round trips in a row had no reply; next try in {left:.1} s)",
                s.failed_in_row
            ));
        }
        s.probing = true;
        Ok(())
    }

    /// A batch that was allowed came back: `reached` when Redis replied at all.
    pub fn record(&self, reached: bool, now: Instant) {
        let mut s = self.state();
        s.probing = false;
        if reached {
            s.failed_in_row = 0;
            s.open_until = None;
            s.backoff = FIRST_BACKOFF;
            return;
        }
        s.failed_in_row = s.failed_in_row.saturating_add(1);
        if s.open_until.is_some() || s.failed_in_row >= TRIP {
            s.open_until = Some(now + s.backoff);
            s.backoff = (s.backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Whether it is open now (batches fail at once).
    #[cfg(test)]
    pub fn is_open(&self) -> bool {
        self.state().open_until.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_backs_off_doubling_probes_once_and_closes_on_a_reply() {
        let b = Breaker::new();
        let t0 = Instant::now();
        for _ in 0..TRIP - 1 {
            assert!(b.allow(t0).is_ok());
            b.record(false, t0);
        }
        assert!(!b.is_open());
        assert!(b.allow(t0).is_ok());
        b.record(false, t0);
        assert!(b.is_open());
        // Open for the first backoff: everything fails at once.
        let e = b.allow(t0 + Duration::from_millis(500)).unwrap_err();
        assert!(
            e.contains("3 round trips in a row") && e.contains("0.5 s"),
            "{e}"
        );
        // Then one probe; others fail at once while it is out.
        let t1 = t0 + FIRST_BACKOFF;
        assert!(b.allow(t1).is_ok());
        assert!(b.allow(t1).is_err());
        // It failed: open again, twice as long.
        b.record(false, t1);
        assert!(b.allow(t1 + FIRST_BACKOFF).is_err());
        let t2 = t1 + 2 * FIRST_BACKOFF;
        assert!(b.allow(t2).is_ok());
        // A reply closes it, and the backoff starts over.
        b.record(true, t2);
        assert!(!b.is_open() && b.allow(t2).is_ok());
        for _ in 0..TRIP {
            b.record(false, t2);
        }
        assert!(b.allow(t2 + FIRST_BACKOFF).is_ok());
    }

    #[test]
    fn the_backoff_is_bounded() {
        let b = Breaker::new();
        let mut t = Instant::now();
        for _ in 0..40 {
            b.record(false, t);
            t += MAX_BACKOFF;
            assert!(
                b.allow(t).is_ok(),
                "a probe at most MAX_BACKOFF after the last"
            );
        }
    }
}
