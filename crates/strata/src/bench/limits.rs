//! The benches' own flags, bounded before anything is allocated or spawned: a count past what a
//! bench can use, a duration or a rate that is not a finite positive number, or buffers past
//! [`MAX_BUFFER_BYTES`] are refused by name (they panicked on an overflow, or allocated until
//! the kernel stopped the process).

use anyhow::{bail, Result};

/// Most bytes of buffers one bench builds (pages × page bytes, a prompt's text, ...).
pub const MAX_BUFFER_BYTES: u64 = 8 << 30;

/// Most requests in flight one bench keeps (`--concurrency`): past it a bench client would
/// hold more sockets than a worker admits, and a value near 2^61 panicked tokio's semaphore.
pub const MAX_CONCURRENCY: usize = 4096;

/// A count of at least 1 and at most `max`.
pub fn count(flag: &str, v: usize, max: usize) -> Result<()> {
    if !(1..=max).contains(&v) {
        bail!("{flag} {v}: expected 1 to {max}");
    }
    Ok(())
}

/// A count of at most `max` (0 allowed).
pub fn at_most(flag: &str, v: usize, max: usize) -> Result<()> {
    if v > max {
        bail!("{flag} {v}: at most {max}");
    }
    Ok(())
}

/// A finite number above 0 and at most `max` (seconds, a rate).
pub fn positive(flag: &str, v: f64, max: f64) -> Result<()> {
    if !(v > 0.0 && v <= max) {
        let v = strata_kv::units::shown_number(v);
        bail!("{flag} {v}: expected a number above 0 and at most {max}");
    }
    Ok(())
}

/// Buffers of `n` × `each` bytes, named by `what`: at most [`MAX_BUFFER_BYTES`].
pub fn buffers(what: &str, n: usize, each: usize) -> Result<()> {
    let total = (n as u128) * (each as u128);
    if total > MAX_BUFFER_BYTES as u128 {
        bail!("{what}: {n} × {each} bytes = {total} bytes of buffers, past the bench's {MAX_BUFFER_BYTES} (8 GiB)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_overflow_is_caught() {
        assert!(count("--n", 1, 4).is_ok() && count("--n", 4, 4).is_ok());
        assert!(count("--n", 0, 4).is_err() && count("--n", 5, 4).is_err());
        assert!(at_most("--w", 0, 4).is_ok() && at_most("--w", 5, 4).is_err());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e30] {
            assert!(positive("--seconds", bad, 1e6).is_err(), "{bad}");
        }
        assert!(positive("--seconds", 0.5, 1e6).is_ok());
        assert!(buffers("--pages × --page-bytes", usize::MAX, usize::MAX).is_err());
        assert!(buffers("--pages × --page-bytes", 128, 368_640).is_ok());
    }
}
