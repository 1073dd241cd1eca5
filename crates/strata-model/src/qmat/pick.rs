//! Whether a single activation row of a flat format (Q4_0, Q4_1, Q8_0) may take a kernel of its
//! own ([`mode`], `STRATA_ONE_ROW_KERNEL`). By default it does not: every row count takes the
//! same kernel, whose per-row bits do not depend on the other rows, so a greedy or seeded
//! answer is the same alone or under load (batch-invariant). `fastest` lets a one-row product
//! take the fastest kernel, measured per format as below (on the machine of docs/BENCHMARKS.md,
//! 4–7 % more single-stream decode tokens per second, and answers that follow the load);
//! `avx2` takes AVX2's one-row kernel without measuring.
//!
//! Under `fastest`: where the CPU has AVX-512 VNNI, which kernel takes the row is measured once
//! per format (at start, or at first use), not assumed from the instruction set. AVX-512's kernel shares each weight group among up to 16 rows, which one row cannot
//! use; AVX2's one-row kernel (`avx2::dot_int_flat`) reduces eight groups at once and scales
//! them with one conversion. Which is faster depends on the core: on AMD Zen 4 (512-bit
//! operations issued as two 256-bit halves) the AVX2 one is 1.46× faster on Q4_1 blocks
//! (docs/BENCHMARKS.md), so a rule by instruction set alone is wrong on one vendor or the
//! other.
//!
//! The AVX2 kernel is picked only when it is at least [`MARGIN`] faster, so that a machine
//! near parity keeps one answer from start to start: the two kernels agree to rounding, not bit
//! for bit, so a one-row product's bits follow the pick (batches never take it). Only calls of
//! exactly one row take the pick. `STRATA_ONE_ROW_KERNEL=avx2` or `=avx512` skips the
//! measurement (any other value measures). `strata_model::load` measures at start, before a
//! forward pass runs.

use std::hint::black_box;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::format::{Format, QActs, GROUP};

/// How much faster (time ratio) the AVX2 one-row kernel must be to be picked: clear of the
/// spread of repeated measurements (on the machine of docs/BENCHMARKS.md, over six starts,
/// Q4_1 1.45–1.55×, Q4_0 1.06–1.18×, Q8_0 1.03–1.11×).
pub(crate) const MARGIN: f64 = 1.30;

/// How a one-row product is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OneRow {
    /// The kernel of every row count (the default; also `STRATA_ONE_ROW_KERNEL=invariant` or
    /// `avx512`).
    Invariant,
    /// The fastest kernel, measured (`STRATA_ONE_ROW_KERNEL=fastest`).
    Fastest,
    /// AVX2's one-row kernel (`STRATA_ONE_ROW_KERNEL=avx2`).
    Avx2,
}

/// `STRATA_ONE_ROW_KERNEL`, read once.
pub(crate) fn mode() -> OneRow {
    static MODE: OnceLock<OneRow> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("STRATA_ONE_ROW_KERNEL").as_deref() {
        Ok("fastest") => OneRow::Fastest,
        Ok("avx2") => OneRow::Avx2,
        Ok("invariant" | "avx512") | Err(_) => OneRow::Invariant,
        Ok(other) => {
            tracing::warn!(value = other, "STRATA_ONE_ROW_KERNEL: expected invariant, fastest or avx2; batch-invariant kernels are used");
            OneRow::Invariant
        }
    })
}

/// The pick per format (indexed as `kernels::FORMATS`).
static PICKS: [OnceLock<Pick>; 7] = [const { OnceLock::new() }; 7];

/// One format's choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Pick {
    pub avx2: bool,
    /// AVX-512 time over AVX2 time for the same work; None when `STRATA_ONE_ROW_KERNEL`
    /// decided.
    pub ratio: Option<f64>,
}

/// The pick from the two kernels' best times.
pub(crate) fn decide(t512: Duration, t2: Duration) -> Pick {
    let ratio = t512.as_secs_f64() / t2.as_secs_f64().max(1e-9);
    Pick {
        avx2: ratio >= MARGIN,
        ratio: Some(ratio),
    }
}

/// The pick for `f` (`index`: its place in the format table), measured with `time_avx512`
/// and `time_avx2` (each: one pass over a test matrix) the first time it is asked for. The
/// measurement must not enter the thread pool (a worker waiting here could take a job that
/// asks for the same pick): the test row is small enough that quantizing it stays on the
/// calling thread.
pub(crate) fn one_row(
    index: usize,
    time_avx512: impl Fn(&[u8], usize, &QActs),
    time_avx2: impl Fn(&[u8], usize, &QActs),
    f: Format,
) -> Pick {
    *PICKS[index].get_or_init(|| {
        match mode() {
            OneRow::Avx2 => {
                return Pick {
                    avx2: true,
                    ratio: None,
                }
            }
            OneRow::Invariant => {
                return Pick {
                    avx2: false,
                    ratio: None,
                }
            }
            OneRow::Fastest => {}
        }
        let (data, groups, x) = test_matrix(f);
        let (t512, t2) = best_of_alternating(
            || time_avx512(&data, groups, &x),
            || time_avx2(&data, groups, &x),
        );
        decide(t512, t2)
    })
}

/// The fastest of eleven timed passes of each, taken in turn (a, b, a, b, ...) so a change of
/// the core's clock meets both, after ~2 ms of untimed passes.
fn best_of_alternating(a: impl Fn(), b: impl Fn()) -> (Duration, Duration) {
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(2) {
        a();
        b();
    }
    let time = |f: &dyn Fn()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };
    let (mut ta, mut tb) = (Duration::MAX, Duration::MAX);
    for _ in 0..11 {
        ta = ta.min(time(&a));
        tb = tb.min(time(&b));
    }
    (ta, tb)
}

/// Rows of the test matrix: 256 × 1,536 weights (SmolLM2's feed-forward width, 220–420 KB:
/// in L2 after the first pass, as a decode step's weights are not, so the kernels' own rates
/// are compared). 48 groups: `QActs::quantize` keeps them on the calling thread.
const ROWS: usize = 256;
const COLS: usize = 1536;

/// A matrix of flat format `f` (random weights, small finite scales) as bytes, its groups per
/// row, and one quantized activation row.
fn test_matrix(f: Format) -> (Vec<u8>, usize, QActs) {
    let bb = f.block_bytes();
    let groups = COLS / GROUP;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u8
    };
    let mut data: Vec<u8> = (0..ROWS * groups * bb).map(|_| next()).collect();
    // The scale (and Q4_1's min) halves first in each block: 0x2000 is 2^-7 in f16, finite.
    let halves = if f == Format::Q4_1 { 2 } else { 1 };
    for block in data.chunks_exact_mut(bb) {
        for h in 0..halves {
            block[2 * h..2 * h + 2].copy_from_slice(&0x2000u16.to_le_bytes());
        }
    }
    let x: Vec<f32> = (0..COLS)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    (data, groups, QActs::quantize(&x))
}

/// One pass of `kernel` over every row of the test matrix (outputs kept alive).
pub(crate) fn pass(
    data: &[u8],
    groups: usize,
    x: &QActs,
    bb: usize,
    kernel: impl Fn(&[u8], &QActs, &mut [f32]),
) {
    let mut out = [0f32; 1];
    for row in data.chunks_exact(groups * bb) {
        kernel(row, x, &mut out);
        black_box(out[0]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avx2_only_past_the_margin() {
        let ms = Duration::from_millis;
        let p = decide(ms(146), ms(100));
        assert!(p.avx2 && (p.ratio.unwrap() - 1.46).abs() < 1e-9);
        assert!(!decide(ms(129), ms(100)).avx2, "1.29× is within the margin");
        assert!(decide(ms(130), ms(100)).avx2);
        assert!(!decide(ms(90), ms(100)).avx2, "AVX-512 faster");
    }
}
